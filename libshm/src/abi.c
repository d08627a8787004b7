/*
 * abi.c -- the layout of the public structs and the values of the public constants, as this
 * library was compiled, for bindings that mirror them (pyshm's ctypes declarations are checked
 * against it by a test: a field added, moved or resized in lshm.h fails there, not at run time
 * as a silently misread struct).
 *
 * One table, built with sizeof/offsetof, so it cannot disagree with the header it is compiled
 * against. Names: "lshm_plan_options" (sizeof), "lshm_plan_options#fields" (how many fields
 * the table lists, all of them), "lshm_plan_options.alignment" (offsetof),
 * "lshm_plan_options.alignment#size" (sizeof the field), "LSHM_STORAGE_SHARED" (the value).
 */
#include "internal.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>

typedef struct abi_entry {
    const char *name;
    uint64_t value;
} abi_entry;

#define ABI_STRUCT(type, nfields) {#type, sizeof(type)}, {#type "#fields", (nfields)}
#define ABI_FIELD(type, field)                                                                \
    {#type "." #field, offsetof(type, field)},                                                \
        {#type "." #field "#size", sizeof(((type *)0)->field)}
#define ABI_CONSTANT(name) {#name, (uint64_t)(name)}

static const abi_entry abi_table[] = {
    ABI_STRUCT(lshm_plan_options, 4),
    ABI_FIELD(lshm_plan_options, alignment),
    ABI_FIELD(lshm_plan_options, flags),
    ABI_FIELD(lshm_plan_options, time_limit),
    ABI_FIELD(lshm_plan_options, capacity),
    ABI_STRUCT(lshm_plan_result, 5),
    ABI_FIELD(lshm_plan_result, arena_size),
    ABI_FIELD(lshm_plan_result, lower_bound),
    ABI_FIELD(lshm_plan_result, optimal),
    ABI_FIELD(lshm_plan_result, strategy),
    ABI_FIELD(lshm_plan_result, seconds),
    ABI_STRUCT(lshm_arena_counters, 8),
    ABI_FIELD(lshm_arena_counters, managed_bytes),
    ABI_FIELD(lshm_arena_counters, arena_bytes),
    ABI_FIELD(lshm_arena_counters, lower_bound),
    ABI_FIELD(lshm_arena_counters, storages),
    ABI_FIELD(lshm_arena_counters, reuse_count),
    ABI_FIELD(lshm_arena_counters, fallback_count),
    ABI_FIELD(lshm_arena_counters, iterations),
    ABI_FIELD(lshm_arena_counters, replans),
    ABI_STRUCT(lshm_export_info, 9),
    ABI_FIELD(lshm_export_info, fd),
    ABI_FIELD(lshm_export_info, offset),
    ABI_FIELD(lshm_export_info, dev),
    ABI_FIELD(lshm_export_info, ino),
    ABI_FIELD(lshm_export_info, file_size),
    ABI_FIELD(lshm_export_info, readonly),
    ABI_FIELD(lshm_export_info, flags),
    ABI_FIELD(lshm_export_info, data),
    ABI_FIELD(lshm_export_info, nbytes),
    ABI_STRUCT(lshm_slab_counters, 3),
    ABI_FIELD(lshm_slab_counters, slabs),
    ABI_FIELD(lshm_slab_counters, memfds),
    ABI_FIELD(lshm_slab_counters, storages),
    ABI_STRUCT(lshm_allocator, 4),
    ABI_FIELD(lshm_allocator, alloc),
    ABI_FIELD(lshm_allocator, free),
    ABI_FIELD(lshm_allocator, ctx),
    ABI_FIELD(lshm_allocator, flags),
    ABI_CONSTANT(LSHM_STORAGE_RESIZABLE),
    ABI_CONSTANT(LSHM_STORAGE_SHARED),
    ABI_CONSTANT(LSHM_STORAGE_READONLY),
    ABI_CONSTANT(LSHM_STORAGE_INPLACE),
    ABI_CONSTANT(LSHM_PLAN_INCLUSIVE),
    ABI_CONSTANT(LSHM_ARENA_SHARED),
    ABI_CONSTANT(LSHM_SLAB_MAX_BYTES),
    ABI_CONSTANT(LSHM_SLAB_BYTES),
    ABI_CONSTANT(LSHM_ALLOCATOR_WHOLE_PAGES),
    ABI_CONSTANT(LSHM_VERSION_MAJOR),
    ABI_CONSTANT(LSHM_VERSION_MINOR),
    ABI_CONSTANT(LSHM_VERSION_PATCH),
    ABI_CONSTANT(LSHM_VERSION_NUMBER),
};

int lshm_abi_value(const char *name, uint64_t *value) {
    if (name == NULL || value == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    for (size_t i = 0; i < sizeof abi_table / sizeof abi_table[0]; i++) {
        if (strcmp(abi_table[i].name, name) == 0) {
            *value = abi_table[i].value;
            return 0;
        }
    }
    return LSHM_FAIL(-ENOENT, "no struct, field or constant named \"%s\" in lshm.h", name);
}
