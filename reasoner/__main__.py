import os
import sys

from reasoner.cli import main

code = main()
if code:  # the error is printed: end here, before orbax's and tensorstore's background threads
  sys.stdout.flush()  # print tracebacks of their own while the interpreter shuts down
  sys.stderr.flush()
  os._exit(code)
sys.exit(code)
