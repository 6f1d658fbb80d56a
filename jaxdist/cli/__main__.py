"""`python -m jaxdist.cli`: what launch, the Slurm script and the JobSet run on each process."""

import sys

from jaxdist.cli.main import main

sys.exit(main())
