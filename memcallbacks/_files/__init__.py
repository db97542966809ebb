"""File output: history.csv, report.json, memory.png, the text report, saved state; written atomically, bounded."""
