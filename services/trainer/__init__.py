"""Trainer: consumes batch manifests (``train.batches``) and their groups (``rollout.groups``),
takes one GRPO/PPO step per manifest, owns the policy's checkpoints in ``weights_dir`` and
publishes ``WeightPublished`` on ``weights``. Entry point: ``python -m services.trainer``;
the wiring is in :mod:`services.trainer.loop`.
"""
