"""The judge's parts: problems on disk, one graded run, reports, the gradebook, the release."""
