from rayapp.cli import main

main()
