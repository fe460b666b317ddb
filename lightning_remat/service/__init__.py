"""The service layer every integration shares: planning, the channel between ranks, the batch-size search."""
