import sys

from tune_recipes._cli.main import main

sys.exit(main())
