"""Process management, apart from the parallel mechanisms it starts: :mod:`.launch` starts and supervises a job's
worker processes under torchrun's elastic agent (from the CLI, or from Python through a fork server), :mod:`.restarts`
tells a restarted worker why it was restarted, and :mod:`.watchdog` turns a hung collective into a one-line error
naming the rank that stopped."""
