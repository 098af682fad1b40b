from kdctl.cli import main

main()
