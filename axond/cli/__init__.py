"""The axond command line (click)."""
