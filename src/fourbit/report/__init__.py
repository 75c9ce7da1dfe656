"""What the report concludes from the records (verdicts) and how it says it."""
