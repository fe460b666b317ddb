"""Targets that are not here: fake tensors for a GPU one lacks, sharded (FSDP2) ranks, the host link."""
