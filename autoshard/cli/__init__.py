"""The command line: `autoshard inspect | plan | verify | run | simulate | demo`."""
