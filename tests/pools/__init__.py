"""Pools: allocation, release, accounting, generations, one lineage."""
