"""The probe: real trial steps of sizes a pure search picks, and what it found."""
