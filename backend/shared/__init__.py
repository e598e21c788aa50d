"""What every layer uses: the CLI exit contract, atomic outputs, shared names and integer helpers, the shared errors."""
