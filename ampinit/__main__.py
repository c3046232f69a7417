"""``python -m ampinit``: print the environment report for bug reports."""

from .env import report

if __name__ == "__main__":
    print(report())
