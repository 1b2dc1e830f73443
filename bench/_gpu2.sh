set -u
timeout 150 python3 bench/bench_cmp_dense.py --T 8192 65536 --copy-to $OUT > $OUT/cmpd.txt 2>&1; echo cmpd rc=$?
tail -12 $OUT/cmpd.txt; grep "T=" $OUT/cmpd.txt | cut -c1-600
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_gpu.py -x -s 2>&1 | tail -15 > $OUT/gputest.txt; cat $OUT/gputest.txt
timeout 200 python3 bench/bench_attention.py --T 8192 65536 --no-peers --iters 5 --copy-to $OUT > $OUT/attn.txt 2>&1; echo attn rc=$?
tail -8 $OUT/attn.txt
