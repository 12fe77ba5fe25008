"""The entry point: the Hydra command line, the checks of a whole job, and the job that strings the
journey together (build, split, verify, dispatch, report). May import: everything."""
