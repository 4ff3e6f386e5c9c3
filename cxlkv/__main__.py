"""`python -m cxlkv ...` = the cxlkv command."""
from cxlkv.cli import entry

entry()
