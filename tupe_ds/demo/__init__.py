"""`make demo`: pretrain a tiny TUPE-R BERT (run), then show what it learned (report)."""
