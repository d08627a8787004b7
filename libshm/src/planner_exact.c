/* planner_exact.c -- placeholder, replaced below */
#include "internal.h"
#include "planner_internal.h"
int lshm__plan_exact(const lshm__plan_problem *p, uint64_t capacity, double deadline,
                     uint64_t *offsets)
{
    (void)p, (void)capacity, (void)deadline, (void)offsets;
    return -1;
}
