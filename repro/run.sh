#!/bin/sh
# usage: repro/run.sh script.py  (from anywhere)
cd /work/h2 && PYTHONPATH=/work/h2 PYSHM_LIBRARY=/work/h2/build/liblshm.so exec /work/incg h2 timeout ${T:-60} /work/venv/bin/python "$@"
