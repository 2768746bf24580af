"""What the commands share: one flag vocabulary and the ways a command exits (`flags`)."""
