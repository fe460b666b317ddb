"""The service layer every integration shares: planning (decide, fall back, broadcast, metrics),
``plan_remat`` for plain PyTorch, and the batch-size search."""
