"""What both strategies do on Lightning's side: failures and exit, per-rank state files, model transforms."""
