"""What a rematerialised computation keeps in memory: see README.md."""
