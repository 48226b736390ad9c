import os
import sys

# Distributed tests pickle module-level workers by name; the ranks import them from this folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
