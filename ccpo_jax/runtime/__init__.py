"""The host side shared by CCPO and Stackelberg: the chunked training loop (:mod:`.loop`),
verified checkpoints (:mod:`.checkpoints`), device sharding and multi-host start
(:mod:`.sharding`), TensorBoard scalars (:mod:`.scalars`)."""
