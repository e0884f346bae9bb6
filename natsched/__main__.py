import sys

from natsched.cli import main

sys.exit(main())
