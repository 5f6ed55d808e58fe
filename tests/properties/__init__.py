"""Property suites: state machines, hostile tables, fault sweeps, misuse."""
