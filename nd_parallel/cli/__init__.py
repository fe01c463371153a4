"""The `nd-parallel` command: demo | train | plan | export | make-tiny (main.py parses and dispatches)."""
