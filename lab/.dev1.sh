#!/usr/bin/env bash
set -u
S=$OUT/summary.txt
t0=$SECONDS
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_CUDA_ARCHS=90a-real -DFLASHC_CUDA_PTXAS_VERBOSE=ON >$OUT/configure.log 2>&1
cmake --build build-gpu -j 16 >$OUT/build.log 2>&1; echo "build rc $? $((SECONDS-t0))s" >>$S
grep -B1 -A2 "fc90_bwd" $OUT/build.log | grep -E "spill" | sort | uniq -c | head >>$S
FB=$(find build-gpu -name gpu_fwd -type f | head -1); BB=$(find build-gpu -name gpu_bwd -type f | head -1)
export PYTHONPATH=python FLASHC_LIBRARY=build-gpu/libflashc.so
timeout 200 $BB >$OUT/gpu_bwd.log 2>&1; echo "gpu_bwd rc $? $((SECONDS-t0))s: $(grep -cE '^ok' $OUT/gpu_bwd.log) ok, $(grep -cE 'FAIL' $OUT/gpu_bwd.log) FAIL; $(tail -2 $OUT/gpu_bwd.log | tr '\n' ' ')" >>$S
for tool in racecheck memcheck; do
  FLASHC_CUDA_LOG=1 timeout 120 compute-sanitizer --tool $tool --error-exitcode 3 python3 bench/run_once.py --d 64 --n 700 --b 4 --h 16 --causal --repeat 1 >$OUT/san_$tool.log 2>&1
  echo "$tool d64 bwd rc $?: $(grep -E 'SUMMARY|backward.* on' $OUT/san_$tool.log | sort | uniq -c | tr '\n' ' ')" >>$S
done
FLASHC_CUDA_LOG=1 timeout 60 python3 lab/unaligned_out_probe.py >$OUT/probe.log 2>&1; echo "probe rc $?" >>$S; grep -vE "CUDA backward" $OUT/probe.log | sort | uniq -c | head -20 >>$S
timeout 200 $FB >$OUT/gpu_fwd.log 2>&1; echo "gpu_fwd rc $? $((SECONDS-t0))s: $(grep -cE '^ok' $OUT/gpu_fwd.log) ok, $(grep -cE 'FAIL' $OUT/gpu_fwd.log) FAIL; $(tail -2 $OUT/gpu_fwd.log | tr '\n' ' ')" >>$S
timeout 120 python3 -m pytest -q -x python/tests -k "cuda or gpu" >$OUT/pytest.log 2>&1; echo "pytest rc $? $((SECONDS-t0))s: $(tail -1 $OUT/pytest.log)" >>$S
cat $S
