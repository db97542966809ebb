"""Base modules: config, findings, units, storage, history columns, the device seam, private torch APIs, collectives. They import nothing above them."""
