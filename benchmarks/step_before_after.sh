#!/bin/bash
# An older build against this one, alternating, 3 rounds: train fit on the default example
# (Fashion-MNIST, 150 steps), the steady-state ms/step of logging windows 2 and 3 of each run.
cd "$(dirname "$0")/.."
OLD=${OLD:-/tmp/old/build}  # a build of the older commit (git worktree + scripts/build)
for r in 1 2 3; do for b in "$OLD" build; do
  rm -rf /tmp/sb_run
  $b/bin/train fit configs/resnet_fashion_mnist.yaml --run-dir /tmp/sb_run --set trainer.max_steps=150 \
    --set logging.every_steps=50 --set trainer.eval_every_steps=1000000 --set logging.tensorboard=false > /tmp/sb.log 2>&1
  echo "round $r $b: $(grep -a -o '[0-9.]* ms/step' /tmp/sb.log | sed -n '2,3p' | tr '\n' ' ')"
done; done
