"""Files a run reads and writes, safely: atomic writes, JSONL with line-numbered errors, and the
locked output directory whose files are published all-or-nothing. Standard library only."""
