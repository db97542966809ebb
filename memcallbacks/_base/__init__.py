"""Base modules: config, findings, units, columns, the device seam, collectives; nothing above them."""
