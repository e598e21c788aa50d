"""The launcher (scripts/train_mcore.sh): its arguments validated once into a RunSpec, the cluster run or the embedded CPU run resolved, checked and started."""
