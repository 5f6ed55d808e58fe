"""The prefix cache: radix tree, sharing, deduplication, hybrid anchors."""
