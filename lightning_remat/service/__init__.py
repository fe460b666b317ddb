"""The service layer every integration shares: planning (decide, fall back, broadcast, metrics), the
one channel between ranks (``channel``),
``plan_remat`` for plain PyTorch, and the batch-size search."""
