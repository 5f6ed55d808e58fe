"""The device-read audit, and the decode path proved on meta."""
