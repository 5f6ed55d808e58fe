"""Memory kinds and their allocators: free lists, the token table, hybrid pools."""
