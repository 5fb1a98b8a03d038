"""Serve the EAGLE chat app: `python launch.py --help`."""

from app.cli import main

if __name__ == "__main__":
    main()
