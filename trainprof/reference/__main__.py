import sys

from trainprof.reference.train import main

sys.exit(main())
