"""`python -m mmcache.server`: the same as `mmcache serve`."""

import sys

from ._cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
