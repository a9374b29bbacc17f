#!/bin/bash
cd /work/main
for r in 2 3; do
  for v in adaptive fixed; do
    if [ $v = fixed ]; then M=32m; else M=256m; fi
    echo "== round $r $v $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    target/release/kvtier bench --model llama3-8b --contexts 4096,65536 --capacity 9g --against-fio --load-inflight-max $M --dir /work/main/kvtier-data/w28 --json /tmp/w28/$v-$r.json 2>&1 | grep -vE "^\[" | tail -14
  done
done
echo DONE
