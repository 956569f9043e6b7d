#!/bin/bash
# checkpoint.async off/on, alternating, 2 rounds: BERT-base (configs/bert_base_mlm.yaml, data from
# scripts/bert-data) on this machine, 6 steps of 4 sequences, a checkpoint every 2. Prints the
# wall time per run; the logs (/tmp/ckrun_<mode>_<round>.log) hold the step and checkpoint lines.
cd "$(dirname "$0")/.."
for r in 1 2; do for m in off on; do
  rm -rf /tmp/ckrun_$m
  start=$(date +%s.%N)
  build/bin/train fit configs/bert_base_mlm.yaml --run-dir /tmp/ckrun_$m --set trainer.global_batch=4 --set trainer.max_steps=6 \
    --set checkpoint.every_steps=2 --set trainer.eval_every_steps=1000000 --set logging.every_steps=1 --set checkpoint.async=$m \
    --set tuning.micro_batch=4 --set logging.tensorboard=false > /tmp/ckrun_${m}_$r.log 2>&1
  end=$(date +%s.%N)
  echo "round $r async=$m wall $(echo "$end - $start" | bc) s; $(grep -a -c 'checkpoint /tmp' /tmp/ckrun_${m}_$r.log) checkpoint lines"
done; done
