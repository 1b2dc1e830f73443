set -u
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_gpu.py -s 2>&1 | grep -v "^$" | tail -14 > $OUT/gputest.txt; cat $OUT/gputest.txt
timeout 150 python3 bench/bench_cmp_dense.py --T 8192 16384 32768 65536 --copy-to $OUT > $OUT/cmpd.txt 2>&1; echo cmpd rc=$?
tail -14 $OUT/cmpd.txt | head -12
timeout 200 python3 bench/bench_attention.py --T 8192 65536 --no-peers --iters 5 --sweep 65536 --sweep-only select. --copy-to $OUT > $OUT/attn.txt 2>&1; echo attn rc=$?
grep "sweep T=65536 select" $OUT/attn.txt
tail -6 $OUT/attn.txt
