"""Failures and slow ranks: resumes after random faults against an uninterrupted run, bit for bit,
and judging stragglers at thousands of ranks."""
