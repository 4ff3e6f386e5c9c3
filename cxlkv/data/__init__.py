"""Data files shipped with cxlkv (systemd units: systemd/)."""
