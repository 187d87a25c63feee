"""Loss scaling: jmp's loss scales, torch's GradScaler and an optax wrapper (issue 3)."""
