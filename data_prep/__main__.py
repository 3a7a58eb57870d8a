import sys

from data_prep.cli import main

sys.exit(main())
