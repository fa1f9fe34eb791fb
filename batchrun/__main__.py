from batchrun._checkout_path import drop_checkout_from_path

drop_checkout_from_path()

from batchrun.cli.main import main  # noqa: E402

main()
