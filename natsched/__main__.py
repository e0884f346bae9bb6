import sys

from natsched.cli.app import main

sys.exit(main())
