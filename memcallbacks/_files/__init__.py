"""File output: history.csv, report.json, memory.png, the text report; written atomically, bounded."""
