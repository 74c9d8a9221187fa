"""The training command of tests/launch/test_elastic.py's elastic jobs: ``torchrun ... -m
tests.launch.held_train ARGS`` is ``-m admm_dist.train ARGS``, except that the ranks of a one-host
world (torchrun's ``GROUP_WORLD_SIZE`` 1: the survivors of a lost host) wait after their
``ADMM_TEST_HOLD_ROUNDS``-th round of that start, its checkpoint written, until their agent stops
them (SIGTERM, the training command's clean stop) to take the host back, or ``HOLD_S`` seconds
have passed. The survivors then cannot finish the run before the host is back, however long its
rejoin takes on a loaded machine, so the run needs only a few rounds after the kill; what is
computed is the training command's (the hold is outside the rounds, after a checkpoint).

Run from the repository root, or with it on ``PYTHONPATH``.
"""
import os
import sys
import time

HOLD_S = 300.0    # then the run goes on (and the test says the host never came back)


def main() -> int:
    from admm_dist.cli import train
    from admm_dist.training.trainer import Trainer

    hold = int(os.environ.get("ADMM_TEST_HOLD_ROUNDS", "0"))
    if hold and os.environ.get("GROUP_WORLD_SIZE") == "1":
        track, done = Trainer.track, []

        def held(self, rec):
            track(self, rec)
            done.append(rec.round)
            if len(done) == hold:
                print(f"held_train: holding after round {rec.round} until this host's agent stops the "
                      f"workers (at most {HOLD_S:.0f} s)", flush=True)
                end = time.monotonic() + HOLD_S
                while time.monotonic() < end:
                    time.sleep(0.1)
        Trainer.track = held
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
